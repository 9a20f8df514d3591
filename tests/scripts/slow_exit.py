"""On SIGTERM, takes SLOW_EXIT_S seconds to 'write its checkpoint', then writes DONE_FILE."""
import os, signal, sys, time
def term(*_):
    time.sleep(float(os.environ["SLOW_EXIT_S"]))
    open(os.environ["DONE_FILE"], "w").write("checkpoint written")
    sys.exit(143)
signal.signal(signal.SIGTERM, term)
open(os.environ["DONE_FILE"] + ".ready", "w").write("ready")
time.sleep(300)
