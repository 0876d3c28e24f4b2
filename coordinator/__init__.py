"""The coordinator: the round loop, the public API and the `svip` CLI."""
