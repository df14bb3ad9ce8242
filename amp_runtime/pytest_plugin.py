"""pytest plugin for amp_runtime (fixture amp_guard); being written."""
