"""gcbs_lib: the one shared package behind the gcbs-kit notebooks, one idea per module (README.md's
layout section names each)."""

__version__ = "0.1.0"
