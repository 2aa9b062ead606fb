"""Maps each root folder to ``llmgw.<folder>`` (ARCHITECTURE §1).

One namespace, because generic top-level names clash with other distributions; the folders
at the root stay the architecture, and ``llmgw`` has no folder of its own. Subpackages are
found, so a new folder under ``services/`` needs no edit here.
"""

from setuptools import find_packages, setup

ROOTS = ["events", "infra", "projections", "services", "agent", "cli", "bench", "modelfiles"]

packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    package_dir[f"llmgw.{root}"] = root
    packages.append(f"llmgw.{root}")
    packages.extend(f"llmgw.{root}.{sub}" for sub in find_packages(root))

# The console's templates, scripts, styles and messages travel in the wheel: nothing is built at install
# and nothing is fetched at run time.
CONSOLE = ["templates/*.html", "static/*", "messages/*/*.json"]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"llmgw.cli": ["*.yaml"], "llmgw.services.console": CONSOLE},
)
