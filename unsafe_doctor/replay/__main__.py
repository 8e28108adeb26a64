"""``torchrun --nproc-per-node N -m unsafe_doctor.replay LOG --adaptor FILE ...``: `verify`, one rank per process."""

import sys

from unsafe_doctor.cli import main

main(["verify", *sys.argv[1:]])
