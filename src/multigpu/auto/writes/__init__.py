"""--auto's rule for files: written once, by rank 0, the others' kept aside."""
