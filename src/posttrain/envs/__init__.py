"""Environments: multi-turn episodes, tools, and the sandbox model-written code runs in."""
