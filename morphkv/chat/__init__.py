"""A conversation with a bounded cache (``conversation``) and its saved sessions (``session``);
the terminal command is ``morphkv.cli.chat``."""
