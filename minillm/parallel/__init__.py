"""One model over several processes on torch.distributed: tensor, sequence and pipeline parallel (lesson 11)."""
