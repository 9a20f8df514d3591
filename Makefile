# The README's commands. `setup` installs what is missing (once per machine, cached).
.PHONY: setup build run test bench clean

setup:
	@scripts/setup.sh

build: setup
	cargo build --release

run: build
	./target/release/oomguard train configs/demo.yaml

test: setup
	cargo test --release --workspace

bench: setup
	cargo bench --bench throughput --bench guard --bench launch --bench auto --bench report

clean:
	cargo clean
