package main

import (
	"github.com/alecthomas/kingpin/v2"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
)

// addHookFlags registers the flags that prolog and epilog share.
func addHookFlags(c *kingpin.CmdClause, o *hooks.Options, name, timeout, grace string) {
	c.Flag("slurm.job-id", "The job.").Envar("SLURM_JOB_ID").PlaceHolder("ID").StringVar(&o.JobID)
	c.Flag("slurm.job-uid", "The job's user, by UID.").Envar("SLURM_JOB_UID").PlaceHolder("UID").StringVar(&o.JobUID)
	c.Flag("slurm.node", "This node's name in Slurm, for --drain.").Envar("SLURMD_NODENAME").PlaceHolder("NAME").StringVar(&o.Node)
	c.Flag("slurm.gpus", "The job's GPUs on this node: indexes as NVML numbers them (Slurm's with gres.conf AutoDetect=nvml) or UUIDs, comma-separated; "+
		"\"all\" for every GPU, \"none\" for none. Default: SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES, else GPU_DEVICE_ORDINAL, which Slurm sets for a "+
		"job given GRES; none when none is set.").PlaceHolder("0,1").StringVar(&o.GPUs)
	c.Flag("store.path", "The remediator's audit database: the "+name+" records its actions there (source "+name+"), and reads the lineage the remediator recorded, "+
		"to name dead owners. Its directory is created (0700) when missing and checked (a directory of this user's, not a link, that no one else may write to), as the remediator does. "+
		"When it cannot be opened, nothing is signalled. Empty: no record.").Default(defaultStorePath).StringVar(&o.StorePath)
	c.Flag("drain", "When memory stays held, also drain the node with the reason (scontrol update nodename=NODE state=drain reason=\"gpu-orphan: ...\").").BoolVar(&o.Drain)
	c.Flag("slurm.scontrol", "The scontrol command, for --drain; looked up in PATH, then in /usr/bin, /usr/local/bin and /opt/slurm/bin (Slurm runs prologs and epilogs without a PATH).").
		Default("scontrol").StringVar(&o.Scontrol)
	cli.DurationVar(c.Flag("timeout", "The time budget of the whole "+name+", kept well under Slurm's PrologEpilogTimeout: past it, the "+name+" stops signalling and says what is left.").
		Default(timeout), &o.Timeout)
	cli.DurationVar(c.Flag("grace", "Time between SIGTERM and SIGKILL.").Default(grace), &o.Grace)
	cli.DurationVar(c.Flag("verify-timeout", "How long to wait for the memory to come back after the signals.").Default("10s"), &o.VerifyTimeout)
	cli.BytesVar(c.Flag("min-bytes", "Memory with no live owner at or below this is clean (NVML charges about 8 MiB per live context to no process). Bytes, or a size with a unit: 256MiB, 1GiB.").
		Default("256MiB"), &o.MinBytes)
	c.Flag("protect", "Also never touch processes that run this executable (repeatable), as the remediator's --remediate.protect.").PlaceHolder("NAME|PATH").StringsVar(&o.Protect)
	c.Flag("log.syslog-socket", "Also send the "+name+"'s one line to the syslog socket here (slurmd keeps a failing "+name+"'s output in its log, not a succeeding one's). Empty: stderr only.").
		Default("/dev/log").StringVar(&o.SyslogSocket)
}
