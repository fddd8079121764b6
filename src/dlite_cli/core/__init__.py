"""What every stage stands on: the typed config, errors, devices and precision, progress, files and run-directory artifacts, memory plans."""
