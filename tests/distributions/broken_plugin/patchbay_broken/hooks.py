"""The entry-point module: importing it fails, as it would if a dependency were missing."""

raise ImportError("this plugin is broken on purpose")
