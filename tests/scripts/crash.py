"""Rank 1 fails with exit code 7 after writing a torchelastic error file; prints the restart count."""
import json, os, sys, time
print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {os.environ['RANK']}", flush=True)
if os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": "ValueError: rank 1 is broken", "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    print("about to fail", file=sys.stderr, flush=True)
    sys.exit(7)
time.sleep(30)  # the launcher must stop this one
