"""Only the optional C helper of the store lives here; everything else is in pyproject.toml.

``store/_varint.c`` speeds up the ``Submit`` path; it is optional: without a C compiler the install
goes on and the store decodes through protobuf's own parser (same results, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("rollbook.store._varint", sources=["store/_varint.c"], optional=True)])
