"""The process's surroundings: environment, optional extras, files, locks, orphans."""
