// Package slurmtest tests `gpu-orphan prolog` and `gpu-orphan epilog`
// with a real Slurm: Debian's slurmctld and slurmd (22.05), started as a
// one-node cluster by the tests themselves, with a GRES of two GPUs whose
// processes run on a simulated node. It holds tests only; scripts/deps.sh
// installs the Slurm packages, and the tests need root, as slurmd does.
package slurmtest
