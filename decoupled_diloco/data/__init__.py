"""Built-in datasets: the text corpus shipped with the package and small image sets."""
