"""The parts `TrainingJob` (coordinator/driver.py) is made of, one responsibility each: the trainer pool's
link (`trainers`), weight publication (`weights`), the schedule and its controller (`sparsity`), the
trained-ids ledger (`ledger`), outside control (`control`), one step (`step`), trainer recovery
(`recovery`) and what the job tells its user (`notices`)."""
