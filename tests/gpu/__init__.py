"""On a CUDA GPU only (the device machine); skipped elsewhere."""
