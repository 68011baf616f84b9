"""gcbs_lib: the one shared package behind the gcbs-kit notebooks, one idea per module (the
README's section "The package" names each)."""

__version__ = "0.1.0"
