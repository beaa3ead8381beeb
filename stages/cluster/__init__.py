"""What a job asks of a cluster (SLURM resources per rule) and how its ranks find each other."""
