"""Your own policies, models and datasets in the pipeline: the modules ``plugins.modules`` names, and
those installed packages declare under the entry-point group ``freeze.plugins``, are imported before a
config's names are resolved, so that what they register (``@register_policy`` from
:mod:`freeze.policies`, ``@register_model`` from :mod:`freeze.pipeline.models`, ``@register_dataset``
from :mod:`freeze.pipeline.data`) is accepted by name in ``freeze.policy``, ``model.arch`` and
``data.dataset`` by a run, a sweep and a study (docs/policies.md).

Imported where names are resolved: the launcher's, sweep's and study's up-front check (preflight)
and each worker before it builds its model and policy. A module that cannot be imported is refused
there in one line.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from freeze.pipeline.config import Config, ConfigError

ENTRY_POINT_GROUP = "freeze.plugins"


def load_plugins(config: Config) -> None:
    """Import the installed packages' plugins and the modules ``config.plugins.modules`` names
    (importing twice costs nothing: Python keeps each module once).

    Raises:
        ConfigError: one line naming the module that cannot be imported and why.
    """
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as e:  # an installed package's plugin that is broken: named, not a traceback
            raise ConfigError(
                f"plugins: the installed entry point {entry.name} = {entry.value} ({ENTRY_POINT_GROUP}) cannot be "
                f"imported ({type(e).__name__}: {e}); accepted: fix or uninstall that package"
            ) from None
    for name in config.plugins.modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            raise ConfigError(
                f"plugins.modules: {name!r} cannot be imported ({type(e).__name__}: {e}); accepted: a module on the "
                "Python path (the folder you run from, PYTHONPATH, or an installed package)"
            ) from None
