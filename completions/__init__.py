"""Generated shell completion scripts for the three commands (bash, zsh, fish)."""
