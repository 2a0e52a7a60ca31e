"""--auto's DataLoaders: split over the processes, streams included."""
