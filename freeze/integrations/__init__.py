"""Adapters that put the Freezer inside the trainers people fine-tune with.

Each submodule imports its trainer (transformers, lightning, timm), so import the one you use:
``from freeze.integrations.transformers import FreezeTrainer``; ``import freeze`` imports none of them.
"""
