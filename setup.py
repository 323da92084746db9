"""Where the packages are: each top-level folder is mapped once under the ``tangram_env`` namespace,
and the subpackages in it are found, not listed. Everything else is in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

#: Import name -> the folder that holds it.
FOLDERS = {
    "tangram_env": "tangram_env",
    "tangram_env.server": "server",
    "tangram_env.envs": "envs",
    "tangram_env.reward_models": "reward_models",
}

setup(
    package_dir=FOLDERS,
    packages=[
        name
        for root, folder in FOLDERS.items()
        for name in [root, *(f"{root}.{sub}" for sub in find_packages(folder))]
    ],
)
