"""The Ray runtime of rayfl: client actors that host clients, the driver actor that runs the loop,
and how many CPUs/GPUs each of them asks for. Thin hosts only: no algorithm math lives here."""
