"""What `paths.*` accepts (conf/paths/: where runs, logs and caches are written)."""

from __future__ import annotations

from posttrain.config.spec import Spec, text

SPECS: dict[str, Spec] = {
    "paths.root_dir": text(),
    "paths.log_dir": text(),
    "paths.cache_dir": text(),
    "paths.output_dir": text(),
}
