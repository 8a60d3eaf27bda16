from setuptools import find_packages, setup

setup(
    name="freeze",
    version="0.2.0",
    description="Adaptive layer freezing for data-parallel fine-tuning in PyTorch",
    python_requires=">=3.11",
    # Only the freeze package is installed: experiments/ and report/ are folders of this repository
    # (configs, research scripts, the write-up) and must not land in site-packages under generic
    # names that other projects also use. Everything a console script needs lives in freeze.pipeline.
    packages=find_packages(include=["freeze", "freeze.*"]),
    # Exact pins live in requirements.txt; these are the ranges the code is written against. The
    # library (freeze, without freeze.pipeline) needs torch and numpy alone; the application behind
    # experiments/ and report/ (freeze.pipeline: data, models, sweeps, studies, the report) is the
    # "study" extra; the trainer integrations (freeze.integrations.*) are extras of their own, and
    # `import freeze` imports none of them.
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "study": ["torchvision>=0.19", "scipy", "pandas", "matplotlib", "tqdm>=4.60"],
        # hf: what FreezeTrainer needs, transformers >= 5 (4.x built DDP inside _wrap_model; the
        # module refuses it on import, so a 4.x the extra let in would fail at the user's first
        # import) and accelerate, which the Trainer refuses to run without. Blocks and the cache of
        # Hugging Face models need no extra (single-process block tests also pass on 4.57.6). The
        # suite runs the versions in requirements.txt (transformers 5.23.0, accelerate 1.15.0).
        "hf": ["transformers>=5", "accelerate>=1.1"],
        "lightning": ["lightning>=2.2"],
        "timm": ["timm>=1.0"],
        # experiment trackers (log.trackers in a run's config; freeze.pipeline.trackers)
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=2.16"],
    },
    entry_points={
        "console_scripts": [
            "freeze-run=freeze.pipeline.run:main",
            "freeze-sweep=freeze.pipeline.sweep:main",
            "freeze-study=freeze.pipeline.study:main",
            "freeze-report=freeze.pipeline.report.cli:main",
        ]
    },
)
