"""The benchmark's server: the project's settings and URLs, plus one no-op endpoint to compare against."""
from config.settings import *

ROOT_URLCONF = "bench.urls"
