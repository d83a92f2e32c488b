"""Package list for setuptools (the rest of the metadata is in pyproject.toml).

The Alembic folder sits at the top of the repository (``migrations/``, where ``alembic``
and the design expect it) and ships inside the wheel as ``memlm.db.migrations``, so
``memlm db upgrade`` works from an installed wheel too (tests/test_packaging.py). A
package-dir mapping is the only way to put it there, and pyproject's ``packages.find``
cannot take extra packages, hence this file.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["memlm*", "service*", "workers*"])
    + ["memlm.db.migrations", "memlm.db.migrations.versions"],
    package_dir={"memlm.db.migrations": "migrations"},
    package_data={
        "memlm.db.migrations": ["script.py.mako"],
        # the dashboard's page templates, script and style (plotly.js comes from plotly)
        "service.dashboard": ["templates/*.html", "static/*.js", "static/*.css"],
        "memlm.encoder": ["probe_text.txt"],  # the precision probe's quality text
    },
)
