"""`svip`: the command line, an application over every package: its parsers (main.py; each knob's
flag from its declaration, knob_flags.py; generate's own flags, request_flags.py), prompt input
(prompts.py), what generate writes (output.py) and docs/usage.md's tables (usage.py). Runs in the
user's process.

May import: anything; nothing imports it."""
