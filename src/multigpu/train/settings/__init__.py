"""The user's settings: the config, its file form and its flag words."""
