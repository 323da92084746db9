"""Adapters for the frameworks people train and run agents with; each is an optional extra.

- :mod:`tangram_env.adapters.mini_swe_agent`: a mini-swe-agent ``Environment`` on a sandbox session.
- :mod:`tangram_env.adapters.skyrl`: a SkyRL-gym ``BaseTextEnv`` over any Tangram env.
- :mod:`tangram_env.adapters.verl`: verl ``BaseTool`` classes over Tangram envs.

Importing a module here imports its framework; nothing in ``tangram_env`` imports them otherwise.
The gymnasium adapter needs no module: ``gymnasium.make_vec("tangram/<id>", n)`` returns Tangram's
own vector env.
"""
