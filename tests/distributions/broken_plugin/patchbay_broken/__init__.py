"""patchbay-broken-plugin: its entry-point module raises at import, like a plugin with a missing dependency."""
