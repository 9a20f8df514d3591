# The README's commands. `setup` installs what is missing (once per machine, cached).
.PHONY: setup build run wheel test test-python fmt docs docs-picture bench gpu-kit gpu-kit-test docker-test clean

setup:
	@scripts/setup.sh

build: setup
	cargo build --release

run: build
	./target/release/oomguard train configs/demo.yaml

# dist/oomguard-*.whl: `pip install` gives `import oomguard` and the `oomguard` command (launch,
# sweep, report), with the user's own torch: see scripts/wheel.sh.
wheel: build
	@scripts/wheel.sh

# The tests drive the binaries' test-only hooks (OOMGUARD_TEST_*, docs/environment.md): they
# are built with the `test-hooks` feature here, and in no other build. One release build serves
# both: the feature changes only this workspace's crates, so the dependencies (libtorch's
# bindings) are built once. `cargo build --release` then puts the plain binary back in
# target/release/ (also when a test fails), and the README's commands (tests/readme.rs,
# compiled only without the hooks) and the Python tests run that one. Clippy's warnings are errors, over every target
# (tests, benches, examples) of every crate but python/ (maturin's), in both builds.
test: setup docs
	cargo fmt --all --check
	cargo clippy --release --workspace --all-targets --features oomguard/test-hooks -- -D warnings
	cargo clippy --release --test readme -- -D warnings
	cargo test --release --workspace --features oomguard/test-hooks || { cargo build --release; exit 1; }
	cargo build --release
	cargo test --release --test readme
	$(MAKE) test-python

# `import oomguard` (python/, built and installed into the venv by setup): tests/python/ in
# real subprocesses, about 3 minutes; the launcher tests run the plain release build
# (`cargo build --release`, which `make build` and `make test` run; `make test-python
# OOMGUARD_BIN=PATH` for another; they need none of the binary's test hooks:
# OOMGUARD_TEST_OOM_AT is the Python guard's own).
OOMGUARD_BIN ?= $(CURDIR)/target/release/oomguard
test-python: setup
	OMP_NUM_THREADS=1 OOMGUARD_BIN=$(OOMGUARD_BIN) .venv/bin/python -m pytest -p no:cacheprovider -rf tests/python

# rustfmt.toml's style, applied to every file (`make fmt`); `make test` checks it.
fmt:
	cargo fmt --all

# The Rust API docs, warnings denied (broken intra-doc links, bad HTML); the doc tests run in
# `cargo test` above. --release reuses the release build's build-script outputs (csrc/).
# tests/docs.rs checks README.md and docs/ against the code.
docs: setup
	RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --workspace

# docs/demo-report.png, the README's picture: the whole demo (configs/demo.yaml, 300 steps,
# about 100 s on 2 cores) from an empty micro-batch cache, so that it starts at a micro-batch
# that does not fit: the picture shows the OOM, the shrink, and the grow-back once the
# simulated pressure lifts at step 120. Then `oomguard report` draws it.
docs-picture: build
	rm -rf runs/docs-picture
	cache=$$(mktemp -d) && OOMGUARD_CACHE=$$cache ./target/release/oomguard train configs/demo.yaml --run-dir runs/docs-picture; status=$$?; rm -rf $$cache; exit $$status
	./target/release/oomguard report runs/docs-picture --out docs/demo-report.png

bench: setup
	cargo bench --bench throughput --bench guard --bench launch --bench auto --bench dist --bench precision --bench torchscript --bench report --bench sweep --bench eager_gpt --bench fused_fit --bench snapshot --bench shard --bench checkpoint --bench python_model --bench scale --bench elastic --bench netns
	OMP_NUM_THREADS=1 .venv/bin/python benches/python/own_loop.py
	OMP_NUM_THREADS=1 .venv/bin/python benches/python/sharded.py
	OMP_NUM_THREADS=1 .venv/bin/python benches/python/hf_trainer.py

# Binaries for a GPU host's own PyTorch (default 2.11): see scripts/gpu-kit.sh.
gpu-kit:
	@scripts/gpu-kit.sh $(TORCH)

# The Docker image built and run for real (CI runs this): see scripts/docker-test.sh.
docker-test:
	@scripts/docker-test.sh

# The kit's CPU half: built, loads its torch, trains the demo, gpu-check.sh runs (CI runs this).
gpu-kit-test:
	@scripts/gpu-kit-test.sh $(TORCH)

clean:
	cargo clean
