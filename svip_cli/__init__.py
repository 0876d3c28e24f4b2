"""`svip`: the command line, an application over every package (it imports them; none imports it)."""
