.PHONY: install run lint docs test test-unit test-ray-e2e bench clean

install:
	@bash scripts/install.sh

run: install
	.venv/bin/servelm serve

# two workers (tests/conftest.py keeps the model's tests on one); --durations and the JUnit XML say where the time
# goes (docs/testing.md keeps the table); the coverage of servelm/ is printed, and fails under pyproject's floor
test: install lint
	.venv/bin/python -m pytest -q -n 2 --durations=40 --junitxml=test-results/junit.xml --cov --cov-report=

lint: install
	.venv/bin/ruff check servelm tests harness
	.venv/bin/mypy

# the reference in docs/ as a MkDocs site, in site/ (strict: a broken link or anchor fails the build)
docs: install
	.venv/bin/mkdocs build --strict -d site

test-unit: install
	.venv/bin/python -m pytest -q -m "not e2e"

# the end-to-end contract suite through `servelm serve --ray` (two replicas on a local two-node Ray cluster)
test-ray-e2e: install
	SERVELM_E2E_RAY=1 .venv/bin/python -m pytest -q tests/e2e

bench: install
	.venv/bin/python -m harness.compare

clean:
	rm -rf .venv build site *.egg-info
