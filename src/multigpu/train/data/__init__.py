"""The data a run trains on: specs, datasets, image folders, crops, decoders."""
