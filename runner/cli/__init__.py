"""Command-line interface (click). Commands live in their own modules, loaded lazily."""
