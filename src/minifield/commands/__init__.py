"""Sub-commands of ``minifield``: one module each, every module defines ``register(subparsers)``."""
