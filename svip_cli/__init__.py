"""`svip`: the command line and its input parsing (prompts.py), an application over every package.
Runs in the user's process.

May import: anything; nothing imports it."""
