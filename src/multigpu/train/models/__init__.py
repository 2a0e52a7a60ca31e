"""The models `--model` names: built-in ones, sequence models, Swin."""
