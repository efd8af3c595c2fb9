"""Built-in backends; importing this package registers every one of them."""

from . import native, flex, flash, sage, xformers  # noqa: F401  (registration side effects)
