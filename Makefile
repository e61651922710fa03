VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup test lint bench-core mutation mutation-resume mutation-report

setup:
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,bench,models,llamacpp,serve,ray,mutation]'
	$(VENV)/bin/adaspec models prepare

test:
	$(VENV)/bin/ruff check src tests experiments
	$(PY) -m pytest -q -rs  # -rs: each skipped test with its reason (a missing extra)

lint:
	$(VENV)/bin/ruff check src tests experiments

bench-core:
	$(PY) experiments/core_humaneval.py

# Mutation testing ([tool.mutmut] in pyproject.toml, docs/mutation.md): mutmut over the decode
# path and the store's integrity code, each mutant against the fast tests that cover it.
# MUTATION_GROUPS picks groups (one mutmut run retests all their mutants), MUTATION_CHILDREN
# the parallel workers (the machine's cores are shared). Results stay in mutants/
# (git-ignored) for the report and `mutmut browse`.
MUTMUT := $(VENV)/bin/mutmut
MUTATION_CHILDREN ?= 1
MUTATION_GROUPS ?= engine verify control draft integrity auto
MUTANTS_engine := 'adaspec.engine.loop.*' 'adaspec.engine.proposal.*' \
	'adaspec.engine.sampling.*' 'adaspec.engine.token_tree.*' 'adaspec.engine.text.*'
MUTANTS_draft := 'adaspec.draft.model.*' 'adaspec.draft.model_tree.*' 'adaspec.draft.ngram.*' \
	'adaspec.draft.rates.*' 'adaspec.draft.base.*'
MUTANTS_auto := 'adaspec.draft.auto.*'
MUTANTS_verify := 'adaspec.verify.*'
MUTANTS_control := 'adaspec.control.*'
# the store's checksums and atomic writes only (not its downloads, conversions or loading)
MUTANTS_integrity := $(shell $(PY) experiments/mutation_report.py --integrity-globs)

mutation:
	@globs=""; for group in $(MUTATION_GROUPS); do \
		case $$group in \
			engine) globs="$$globs $(MUTANTS_engine)";; draft) globs="$$globs $(MUTANTS_draft)";; \
			verify) globs="$$globs $(MUTANTS_verify)";; control) globs="$$globs $(MUTANTS_control)";; \
			integrity) globs="$$globs $(MUTANTS_integrity)";; auto) globs="$$globs $(MUTANTS_auto)";; \
			*) echo "unknown group $$group (groups: engine verify control draft integrity auto)"; \
			   exit 2;; \
		esac; \
	done; \
	echo "== mutmut: $(MUTATION_GROUPS)"; \
	eval $(MUTMUT) run --max-children $(MUTATION_CHILDREN) $$globs
	$(MAKE) mutation-report

# Run only the mutants of MUTATION_GROUPS no run has checked yet (after an interrupted run).
mutation-resume:
	$(MUTMUT) run --max-children $(MUTATION_CHILDREN) \
		$$($(PY) experiments/mutation_report.py --unchecked $(MUTATION_GROUPS))
	$(MAKE) mutation-report

mutation-report:
	$(PY) experiments/mutation_report.py --write docs/mutation.md
