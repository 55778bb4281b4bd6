# The two commands README.md opens with. Both set up everything first (scripts/setup.sh).
#   make bench   main job: KVShrink vs stock LMCache on the shipped default store (configs/store-default.yaml)
#   make test    the test suite (CI runs exactly this through .ci/run)
# Extra arguments: make bench ARGS="--quick"   make test ARGS="-m 'not e2e'"

.PHONY: setup bench test

setup:
	scripts/setup.sh

bench: setup
	.venv/bin/kvshrink bench $(ARGS)

test: setup
	.venv/bin/python -m pytest $(ARGS)
