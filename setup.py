from setuptools import find_packages, setup

setup(
    name="freeze",
    version="0.1.0",
    description="Adaptive layer freezing for data-parallel fine-tuning in PyTorch",
    python_requires=">=3.11",
    packages=find_packages(include=["freeze", "freeze.*", "experiments", "report"]),
    # Exact pins live in requirements.txt; these are the ranges the code is written against.
    install_requires=["torch>=2.4", "torchvision>=0.19", "numpy", "scipy", "pandas", "matplotlib"],
    entry_points={
        "console_scripts": [
            "freeze-run=experiments.run:main",
            "freeze-sweep=experiments.sweep:main",
            "freeze-report=report.__main__:main",
        ]
    },
)
