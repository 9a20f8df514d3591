# The README's commands. `setup` installs what is missing (once per machine, cached).
.PHONY: setup build run test bench gpu-kit gpu-kit-test docker-test clean

setup:
	@scripts/setup.sh

build: setup
	cargo build --release

run: build
	./target/release/oomguard train configs/demo.yaml

test: setup
	cargo test --release --workspace

bench: setup
	cargo bench --bench throughput --bench guard --bench launch --bench auto --bench dist --bench precision --bench torchscript --bench report --bench sweep --bench eager_gpt --bench fused_fit --bench snapshot --bench shard

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
