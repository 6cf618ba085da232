.PHONY: install run test test-unit test-e2e bench clean

install:
	@bash scripts/install.sh

run: install
	.venv/bin/servelm serve

test: install
	.venv/bin/python -m pytest -q

test-unit: install
	.venv/bin/python -m pytest -q -m "not e2e"

bench: install
	.venv/bin/python -m bench.compare

clean:
	rm -rf .venv build *.egg-info
