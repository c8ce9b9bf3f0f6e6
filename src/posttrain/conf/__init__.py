"""The Hydra configs, shipped inside the package (`conf/` at the top of the source tree links
here), so an installed `posttrain` finds them from any working directory."""

from pathlib import Path

CONFIG_DIR = str(Path(__file__).resolve().parent)
