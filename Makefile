VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup test lint bench-core mutation mutation-resume mutation-report

# scripts/setup.sh: the venv, adaspec with every extra, the built-in models, the native builds
# (the slow phases side by side; each prints its time)
setup:
	@VENV=$(VENV) bash scripts/setup.sh

test:
	$(VENV)/bin/ruff check src tests experiments
	$(VENV)/bin/mypy
	@# -rs: each skipped test with its reason (a missing extra); the 15 slowest, to keep the
	@# suite in its 10 minutes; two workers, a test file each (tests run one thread each), the
	@# longest files first (tests/file_order.py, not xdist's order by number of tests)
	$(PY) -m pytest -q -rs --durations=15 -n 2 --dist loadfile --no-loadscope-reorder

lint:
	$(VENV)/bin/ruff check src tests experiments
	$(VENV)/bin/mypy

bench-core:
	$(PY) experiments/core_humaneval.py

# Mutation testing ([tool.mutmut] in pyproject.toml, docs/mutation.md): mutmut over the decode
# path and the store's integrity code, each mutant against the fast tests that cover it.
# MUTATION_GROUPS picks groups (one mutmut run retests all their mutants), MUTATION_CHILDREN
# the parallel workers (the machine's cores are shared). Results stay in mutants/
# (git-ignored) for the report and `mutmut browse`.
MUTMUT := $(VENV)/bin/mutmut
MUTATION_CHILDREN ?= 1
# groups (GROUPS in experiments/mutation_report.py): engine draft auto s2d verify control
# integrity (the store's checksums and atomic writes only, not its downloads or conversions)
MUTATION_GROUPS ?= engine verify control draft auto s2d integrity

mutation:
	@echo "== mutmut: $(MUTATION_GROUPS)"
	globs="$$($(PY) experiments/mutation_report.py --globs $(MUTATION_GROUPS))" || exit 2; \
	eval $(MUTMUT) run --max-children $(MUTATION_CHILDREN) $$globs
	$(MAKE) mutation-report

# Run only the mutants of MUTATION_GROUPS no run (here or in the ledger) has checked yet;
# MUTATION_SAMPLE=0.2 runs a random fifth of them (MUTATION_SEED picks which).
MUTATION_SAMPLE ?= 1
MUTATION_SEED ?= 0
mutation-resume:
	$(MUTMUT) run --max-children $(MUTATION_CHILDREN) \
		$$($(PY) experiments/mutation_report.py --unchecked $(MUTATION_GROUPS) \
			--sample $(MUTATION_SAMPLE) --seed $(MUTATION_SEED))
	$(MAKE) mutation-report

# add this machine's results to the committed ledger, then write the table from it
mutation-report:
	$(PY) experiments/mutation_report.py --record --write docs/mutation.md
