"""The swarm-vs-silo experiment's parts: its arms and testbeds as data (`grids`), the statistics that pair each arm
with the same nodes alone (`paired`), and the tables and figure drawn from the saved JSON (`report`). The driver is
scripts/bench/sapo_experiment.py."""
