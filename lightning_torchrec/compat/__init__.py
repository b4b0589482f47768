"""Every private or version-sensitive name of torch, TorchRec, fbgemm and Lightning.

``upstream`` holds torch's, TorchRec's and fbgemm's; ``upstream_warnings`` the warnings only they
can fix, each with its cause; ``lightning`` holds Lightning's, for the glue alone; ``pipelines``
subclasses TorchRec's train pipelines where Lightning's loop takes over; ``managed_collision``
reads TorchRec's managed-collision internals for the export; ``worker_fork`` forks loader workers
around a deadlock of CPython before 3.12; ``c10d`` reaches the job's store. Nothing else in the
package touches a private name.
"""
