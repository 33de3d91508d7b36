"""What runs a model: platform, prepared variants, caches, step runners, search, engines, workers."""
