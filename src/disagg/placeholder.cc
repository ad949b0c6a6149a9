// Placeholder until the connector sources land; removed then.
